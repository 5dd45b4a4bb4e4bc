#include "shim/abi/exports.h"

#include <algorithm>
#include <iterator>

namespace rdmavirt::shim {
namespace {

// Reasons shared by many entries.
constexpr const char* kTranslated =
    "translates shadow objects and identities; real objects (from libibverbs or a provider) "
    "pass through.";
constexpr const char* kTranslatedCompat =
    "translates shadow objects and identities; real objects pass through. Its IBVERBS_1.0 "
    "version serves programs built before libibverbs 1.1 (2006), which take other structs: "
    "not supported under the shim (docs/shim.md).";
constexpr const char* kRealDeviceCompat =
    "takes a device, and devices are the real ones (the shim does not shadow them). Its "
    "IBVERBS_1.0 version is for programs built before libibverbs 1.1: not supported.";
constexpr const char* kProviderOnly =
    "provider ABI: providers call it on their own real objects; it takes provider-internal "
    "structures that no application can build, and defining it would capture the providers' "
    "own calls.";
constexpr const char* kRdmacm =
    "librdmacm reaches verbs objects only through libibverbs' exported names (bound to the "
    "shim's definitions) and the inline verbs (dispatched through the shadows' ops), and reads "
    "only public fields, which shadows carry.";
constexpr const char* kRdmacmChannel =
    "librdmacm's own, then its channel made virtual (shim/cm/cm.h): the fd the program holds "
    "is the shim's, so that its connections can move; librdmacm calls it through its PLT for "
    "the channels it makes itself too.";
constexpr const char* kRsockets =
    "rsockets: sockets and buffers over librdmacm and verbs as above; no verbs object crosses "
    "it.";
constexpr const char* kEnumString = "no object: the name of an enum value.";
constexpr const char* kArithmetic = "no object: arithmetic on rates.";
constexpr const char* kKernelAbi =
    "no object: converts between a kernel ABI struct and the user one.";
constexpr const char* kImportRefused =
    "an object shared with another process cannot move with this one: NULL, errno EOPNOTSUPP.";
constexpr const char* kUnimportRefused =
    "nothing is ever imported under the shim, so the object is one it made: left as it is, "
    "errno EOPNOTSUPP.";

constexpr ExportRule kRules[] = {
    {"__ioctl_final_num_attrs", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"__verbs_log", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"_ibv_query_gid_ex", "IBVERBS_1.11", ExportClass::kShim, kTranslated},
    {"_ibv_query_gid_table", "IBVERBS_1.11", ExportClass::kShim, kTranslated},
    {"_verbs_init_and_alloc_context", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi,
     kProviderOnly},
    {"execute_ioctl", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_ack_async_event", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_ack_cq_events", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_alloc_pd", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_attach_mcast", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_close_device", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_cmd_advise_mr", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_alloc_dm", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_alloc_mw", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_alloc_pd", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_attach_mcast", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_close_xrcd", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_create_ah", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_create_counters", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_create_cq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_create_cq_ex", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_create_flow", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_create_flow_action_esp", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi,
     kProviderOnly},
    {"ibv_cmd_create_qp", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_create_qp_ex2", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_create_qp_ex", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_create_rwq_ind_table", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi,
     kProviderOnly},
    {"ibv_cmd_create_srq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_create_srq_ex", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_create_wq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_dealloc_mw", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_dealloc_pd", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_dereg_mr", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_destroy_ah", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_destroy_counters", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_destroy_cq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_destroy_flow", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_destroy_flow_action", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_destroy_qp", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_destroy_rwq_ind_table", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi,
     kProviderOnly},
    {"ibv_cmd_destroy_srq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_destroy_wq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_detach_mcast", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_free_dm", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_get_context", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_modify_cq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_modify_flow_action_esp", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi,
     kProviderOnly},
    {"ibv_cmd_modify_qp", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_modify_qp_ex", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_modify_srq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_modify_wq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_open_qp", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_open_xrcd", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_poll_cq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_post_recv", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_post_send", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_post_srq_recv", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_query_context", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_query_device_any", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_query_mr", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_query_port", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_query_qp", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_query_srq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_read_counters", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_reg_dm_mr", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_reg_dmabuf_mr", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_reg_mr", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_req_notify_cq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_rereg_mr", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_cmd_resize_cq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_copy_ah_attr_from_kern", "IBVERBS_1.1", ExportClass::kPassThrough, kKernelAbi},
    {"ibv_copy_path_rec_from_kern", "IBVERBS_1.0", ExportClass::kPassThrough, kKernelAbi},
    {"ibv_copy_path_rec_to_kern", "IBVERBS_1.0", ExportClass::kPassThrough, kKernelAbi},
    {"ibv_copy_qp_attr_from_kern", "IBVERBS_1.0", ExportClass::kPassThrough, kKernelAbi},
    {"ibv_create_ah", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_create_ah_from_wc", "IBVERBS_1.1", ExportClass::kShim, kTranslated},
    {"ibv_create_comp_channel", "IBVERBS_1.0", ExportClass::kShim, kTranslated},
    {"ibv_create_cq", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_create_qp", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_create_srq", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_dealloc_pd", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_dereg_mr", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_destroy_ah", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_destroy_comp_channel", "IBVERBS_1.0", ExportClass::kShim, kTranslated},
    {"ibv_destroy_cq", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_destroy_qp", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_destroy_srq", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_detach_mcast", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_dofork_range", "IBVERBS_1.1", ExportClass::kPassThrough,
     "no object: an address range (madvise)."},
    {"ibv_dontfork_range", "IBVERBS_1.1", ExportClass::kPassThrough,
     "no object: an address range (madvise)."},
    {"ibv_event_type_str", "IBVERBS_1.1", ExportClass::kPassThrough, kEnumString},
    {"ibv_fork_init", "IBVERBS_1.1", ExportClass::kPassThrough,
     "no object: process-wide state of the one libibverbs the shim also uses."},
    {"ibv_free_device_list", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_get_async_event", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_get_cq_event", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_get_device_guid", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kPassThrough,
     kRealDeviceCompat},
    {"ibv_get_device_index", "IBVERBS_1.9", ExportClass::kPassThrough,
     "takes a device: devices are the real ones."},
    {"ibv_get_device_list", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_get_device_name", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kPassThrough,
     kRealDeviceCompat},
    {"ibv_get_pkey_index", "IBVERBS_1.5", ExportClass::kShim, kTranslated},
    {"ibv_get_sysfs_path", "IBVERBS_1.0", ExportClass::kPassThrough, "no object: a path."},
    {"ibv_import_device", "IBVERBS_1.10", ExportClass::kRefused, kImportRefused},
    {"ibv_import_dm", "IBVERBS_1.13", ExportClass::kRefused, kImportRefused},
    {"ibv_import_mr", "IBVERBS_1.10", ExportClass::kRefused, kImportRefused},
    {"ibv_import_pd", "IBVERBS_1.10", ExportClass::kRefused, kImportRefused},
    {"ibv_init_ah_from_wc", "IBVERBS_1.1", ExportClass::kShim, kTranslated},
    {"ibv_is_fork_initialized", "IBVERBS_1.13", ExportClass::kPassThrough, "no object."},
    {"ibv_modify_qp", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_modify_srq", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_node_type_str", "IBVERBS_1.1", ExportClass::kPassThrough, kEnumString},
    {"ibv_open_device", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_port_state_str", "IBVERBS_1.1", ExportClass::kPassThrough, kEnumString},
    {"ibv_qp_to_qp_ex", "IBVERBS_1.6", ExportClass::kShim, kTranslated},
    {"ibv_query_device", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_query_ece", "IBVERBS_1.10", ExportClass::kShim, kTranslated},
    {"ibv_query_gid", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_query_gid_type", "IBVERBS_PRIVATE_34", ExportClass::kShim, kTranslated},
    {"ibv_query_pkey", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_query_port", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_query_qp", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_query_qp_data_in_order", "IBVERBS_1.14", ExportClass::kShim, kTranslated},
    {"ibv_query_srq", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_rate_to_mbps", "IBVERBS_1.1", ExportClass::kPassThrough, kArithmetic},
    {"ibv_rate_to_mult", "IBVERBS_1.0", ExportClass::kPassThrough, kArithmetic},
    {"ibv_read_ibdev_sysfs_file", "IBVERBS_PRIVATE_34", ExportClass::kPassThrough,
     "takes a device (real) and reads sysfs."},
    {"ibv_read_sysfs_file", "IBVERBS_1.0", ExportClass::kPassThrough,
     "no object: reads a sysfs file."},
    {"ibv_reg_dmabuf_mr", "IBVERBS_1.12", ExportClass::kRefused,
     "dma-buf memory cannot be re-registered on another host: NULL, EOPNOTSUPP"},
    {"ibv_reg_mr", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_reg_mr_iova2", "IBVERBS_1.8", ExportClass::kShim, kTranslated},
    {"ibv_reg_mr_iova", "IBVERBS_1.7", ExportClass::kShim, kTranslated},
    {"ibv_register_driver", "IBVERBS_1.1", ExportClass::kProviderAbi, kProviderOnly},
    {"ibv_rereg_mr", "IBVERBS_1.1", ExportClass::kShim, kTranslated},
    {"ibv_resize_cq", "IBVERBS_1.0 IBVERBS_1.1", ExportClass::kShim, kTranslatedCompat},
    {"ibv_resolve_eth_l2_from_gid", "IBVERBS_1.1", ExportClass::kShim, kTranslated},
    {"ibv_set_ece", "IBVERBS_1.10", ExportClass::kShim, kTranslated},
    {"ibv_unimport_dm", "IBVERBS_1.13", ExportClass::kRefused, kUnimportRefused},
    {"ibv_unimport_mr", "IBVERBS_1.10", ExportClass::kRefused, kUnimportRefused},
    {"ibv_unimport_pd", "IBVERBS_1.10", ExportClass::kRefused, kUnimportRefused},
    {"ibv_wc_status_str", "IBVERBS_1.1", ExportClass::kPassThrough, kEnumString},
    {"mbps_to_ibv_rate", "IBVERBS_1.1", ExportClass::kPassThrough, kArithmetic},
    {"mult_to_ibv_rate", "IBVERBS_1.0", ExportClass::kPassThrough, kArithmetic},
    {"verbs_allow_disassociate_destroy", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi,
     kProviderOnly},
    {"verbs_init_cq", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"verbs_open_device", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"verbs_register_driver_34", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"verbs_set_ops", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"verbs_uninit_context", "IBVERBS_PRIVATE_34", ExportClass::kProviderAbi, kProviderOnly},
    {"raccept", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rbind", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rclose", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rconnect", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rdma_accept", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_ack_cm_event", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_bind_addr", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_connect", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_create_ep", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_create_event_channel", "RDMACM_1.0", ExportClass::kShim, kRdmacmChannel},
    {"rdma_create_id", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_create_qp", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_create_qp_ex", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_create_srq", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_create_srq_ex", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_destroy_ep", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_destroy_event_channel", "RDMACM_1.0", ExportClass::kShim, kRdmacmChannel},
    {"rdma_destroy_id", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_destroy_qp", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_destroy_srq", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_disconnect", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_establish", "RDMACM_1.2", ExportClass::kPassThrough, kRdmacm},
    {"rdma_event_str", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_free_devices", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_freeaddrinfo", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_get_cm_event", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_get_devices", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_get_dst_port", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_get_remote_ece", "RDMACM_1.3", ExportClass::kPassThrough, kRdmacm},
    {"rdma_get_request", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_get_src_port", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_getaddrinfo", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_init_qp_attr", "RDMACM_1.2", ExportClass::kPassThrough, kRdmacm},
    {"rdma_join_multicast", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_join_multicast_ex", "RDMACM_1.1", ExportClass::kPassThrough, kRdmacm},
    {"rdma_leave_multicast", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_listen", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_migrate_id", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_notify", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_reject", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_reject_ece", "RDMACM_1.3", ExportClass::kPassThrough, kRdmacm},
    {"rdma_resolve_addr", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_resolve_route", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rdma_set_local_ece", "RDMACM_1.3", ExportClass::kPassThrough, kRdmacm},
    {"rdma_set_option", "RDMACM_1.0", ExportClass::kPassThrough, kRdmacm},
    {"rfcntl", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rgetpeername", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rgetsockname", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rgetsockopt", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"riomap", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"riounmap", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"riowrite", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rlisten", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rpoll", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rread", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rreadv", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rrecv", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rrecvfrom", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rrecvmsg", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rselect", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rsend", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rsendmsg", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rsendto", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rsetsockopt", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rshutdown", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rsocket", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rwrite", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
    {"rwritev", "RDMACM_1.0", ExportClass::kPassThrough, kRsockets},
};

}  // namespace

std::span<const ExportRule> ExportRules() { return kRules; }

const ExportRule* FindExportRule(std::string_view name) {
  auto it = std::find_if(std::begin(kRules), std::end(kRules),
                         [name](const ExportRule& r) { return name == r.name; });
  return it != std::end(kRules) ? &*it : nullptr;
}

}  // namespace rdmavirt::shim
