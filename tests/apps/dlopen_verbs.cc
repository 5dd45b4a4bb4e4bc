// Loads libibverbs the way NCCL does (dlopen, then dlvsym with
// "IBVERBS_1.1" on that handle) and prints what it sees of the first
// device: its name and the GID at --gid-idx. Under the shim the GID is the
// virtual one, which shows that handle lookups reached the shim. Also
// prints whether dlsym(RTLD_NEXT, ...) and dlsym(RTLD_DEFAULT, ...) agree
// for a verbs name, as they must from the main program.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <infiniband/verbs.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

template <typename Fn>
Fn Lookup(void* handle, const char* name) {
  void* f = dlvsym(handle, name, "IBVERBS_1.1");
  if (f == nullptr) {
    fprintf(stderr, "dlopen_verbs: dlvsym(%s): %s\n", name, dlerror());
    exit(1);
  }
  return reinterpret_cast<Fn>(f);
}

}  // namespace

int main(int argc, char** argv) {
  int gid_index = 1;
  if (argc == 3 && strcmp(argv[1], "--gid-idx") == 0) gid_index = atoi(argv[2]);
  void* h = dlopen("libibverbs.so.1", RTLD_NOW);
  if (h == nullptr) {
    fprintf(stderr, "dlopen_verbs: %s\n", dlerror());
    return 1;
  }
  auto get_list = Lookup<ibv_device** (*)(int*)>(h, "ibv_get_device_list");
  auto free_list = Lookup<void (*)(ibv_device**)>(h, "ibv_free_device_list");
  auto open_device = Lookup<ibv_context* (*)(ibv_device*)>(h, "ibv_open_device");
  auto close_device = Lookup<int (*)(ibv_context*)>(h, "ibv_close_device");
  auto query_gid = Lookup<int (*)(ibv_context*, uint8_t, int, ibv_gid*)>(h, "ibv_query_gid");
  auto get_name = Lookup<const char* (*)(ibv_device*)>(h, "ibv_get_device_name");

  int n = 0;
  ibv_device** list = get_list(&n);
  if (list == nullptr || n == 0) {
    fprintf(stderr, "dlopen_verbs: no RDMA device\n");
    return 1;
  }
  ibv_context* ctx = open_device(list[0]);
  if (ctx == nullptr) {
    fprintf(stderr, "dlopen_verbs: ibv_open_device failed\n");
    return 1;
  }
  ibv_gid gid;
  if (query_gid(ctx, 1, gid_index, &gid) != 0) {
    fprintf(stderr, "dlopen_verbs: ibv_query_gid failed\n");
    return 1;
  }
  char text[INET6_ADDRSTRLEN];
  inet_ntop(AF_INET6, gid.raw, text, sizeof(text));
  printf("device %s gid[%d] %s\n", get_name(list[0]), gid_index, text);
  printf(
      "rtld_next agrees with rtld_default: %s\n",
      dlsym(RTLD_NEXT, "ibv_open_device") == dlsym(RTLD_DEFAULT, "ibv_open_device") ? "yes" : "no");
  close_device(ctx);
  free_list(list);
  dlclose(h);
  return 0;
}
