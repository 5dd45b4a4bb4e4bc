#include "tools/rdmavirtctl/snapshot.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tools/rdmavirtctl/cli.h"
#include "tools/rdmavirtctl/domain_xml.h"
#include "tools/rdmavirtctl/format.h"
#include "tools/rdmavirtctl/guest_agent.h"
#include "tools/rdmavirtctl/libvirt.h"

namespace rdmavirt::ctl {
namespace {

constexpr char kGroupHeader[] = "rdmavirt group:";

struct Member {
  std::string domain, uri;
  Conn conn;
  Domain dom;
  std::string Label() const { return absl::StrCat(domain, "@", uri); }
};

// Opens each "DOMAIN[@URI]" of `labels` and finds its domain; with
// `running`, it must run and be an RDMA guest.
absl::Status OpenMembers(const std::vector<std::string>& labels, const std::string& default_uri,
                         bool running, std::vector<Member>* out) {
  for (const std::string& label : labels) {
    Member m;
    std::tie(m.domain, m.uri) = ParseMember(label, default_uri);
    if (m.domain.empty() || m.uri.empty())
      return absl::InvalidArgumentError(absl::StrCat("\"", label, "\" names no domain"));
    for (const Member& other : *out)
      if (other.Label() == m.Label())
        return absl::InvalidArgumentError(absl::StrCat(m.Label(), " is named twice"));
    absl::StatusOr<Conn> c = Open(m.uri);
    if (!c.ok()) return c.status();
    m.conn = *std::move(c);
    m.dom.reset(lv->virDomainLookupByName(m.conn.get(), m.domain.c_str()));
    if (m.dom == nullptr)
      return absl::NotFoundError(LibvirtError(absl::StrCat("domain ", m.domain, " at ", m.uri)));
    if (running) {
      if (lv->virDomainIsActive(m.dom.get()) != 1)
        return absl::FailedPreconditionError(absl::StrCat("domain ", m.domain, " is not running"));
      if (!IsRdmaGuest(m.dom.get()))
        return absl::FailedPreconditionError(
            absl::StrCat("domain ", m.domain, " is not an RDMA guest (no <metadata> element in ",
                         kGuestMetadataUri, "); snapshot it with virsh"));
    }
    out->push_back(std::move(m));
  }
  return absl::OkStatus();
}

void PrintSnapshotReport(const SnapshotOptions& o, const v1::SnapshotReport& r) {
  if (o.vm.json) {
    printf("%s\n", Json(r).c_str());
    return;
  }
  printf("%s %s of %s %s%s\n", r.kind().c_str(), r.name().c_str(),
         r.members().empty() ? o.vm.domain.c_str() : absl::StrJoin(r.members(), ", ").c_str(),
         r.ok() ? "done" : (r.rolled_back() ? "FAILED, rolled back" : "FAILED"),
         r.ok() ? "" : absl::StrCat(": ", r.error()).c_str());
  int endpoints = 0;
  for (const v1::GuestReport& g : r.resumed()) endpoints += g.endpoints_size();
  printf("  endpoints %d, RDMA blackout %s (the longest a peer waited)\n", endpoints,
         Micros(r.blackout_us()).c_str());
  printf("  suspend %s, %s %s, resume %s, total %s\n", Micros(r.suspend_us()).c_str(),
         r.kind().c_str(), Micros(r.snapshot_us()).c_str(), Micros(r.resume_us()).c_str(),
         Micros(r.total_us()).c_str());
}

// A snapshot or revert under way: its members and its report, printed
// once, at the end. Each step returns kOk to go on, else the exit code
// (after the report).
struct GroupRun {
  GroupRun(const SnapshotOptions& options, const char* kind) : o(options) {
    rep.set_kind(kind);
    rep.set_name(o.name);
  }
  int Fail(const std::string& why, bool rolled_back) {
    rep.set_ok(false);
    rep.set_error(why);
    rep.set_rolled_back(rolled_back);
    fprintf(stderr, "rdmavirtctl: %s %s: %s\n", rep.kind().c_str(), o.name.c_str(), why.c_str());
    return End(kFailed);
  }
  int Done() {
    rep.set_ok(true);
    return End(kOk);
  }
  int End(int rc) {
    rep.set_total_us(MicrosSince(start));
    PrintSnapshotReport(o, rep);
    return rc;
  }

  // Resumes the first `n` members, in order (a member whose peers are still
  // suspended waits, paused, for them); "" or what failed.
  std::string Resume(size_t n) {
    std::vector<std::string> errors;
    for (size_t i = 0; i < n; ++i) {
      fprintf(stderr, "%s: resuming its RDMA endpoints; their peers reconnect\n",
              members[i].domain.c_str());
      absl::StatusOr<v1::GuestReport> back =
          GuestStep(members[i].dom.get(), o.vm.guest_command, {"resume", "--json"});
      if (!back.ok()) {
        errors.push_back(absl::StrCat(members[i].domain, ": ", back.status().message()));
        continue;
      }
      rep.set_blackout_us(std::max(rep.blackout_us(), LongestBlackout(*back)));
      *rep.add_resumed() = *std::move(back);
    }
    return absl::StrJoin(errors, "; ");
  }
  // The last step: every member resumed, timed, after `done` (what the
  // failure then says is done already).
  int ResumeAll(absl::string_view done) {
    const absl::Time t = absl::Now();
    const std::string back = Resume(members.size());
    rep.set_resume_us(MicrosSince(t));
    if (!back.empty())
      return Fail(absl::StrCat(done, ", but resuming failed: ", back, "; run `", o.vm.guest_command,
                               " resume` in those guests"),
                  false);
    return Done();
  }
  // A failure after `back` ("" or what resuming the members said).
  int FailResumed(absl::string_view cause, const std::string& back) {
    return Fail(
        absl::StrCat(cause, back.empty() ? "" : " (resuming: ", back, back.empty() ? "" : ")"),
        back.empty());
  }

  const SnapshotOptions& o;
  const absl::Time start = absl::Now();
  v1::SnapshotReport rep;
  std::vector<Member> members;
};

// ---- snapshot

int CheckSnapshotMembers(GroupRun* run) {
  const SnapshotOptions& o = run->o;
  std::vector<std::string> labels = {o.vm.domain};
  labels.insert(labels.end(), o.with.begin(), o.with.end());
  if (absl::Status st = OpenMembers(labels, o.vm.connect, true, &run->members); !st.ok())
    return run->Fail(absl::StrCat(st.message(), "; nothing was suspended"), false);
  for (const Member& m : run->members) {
    run->rep.add_members(m.Label());
    Snap existing(lv->virDomainSnapshotLookupByName(m.dom.get(), o.name.c_str(), 0));
    if (existing != nullptr)
      return run->Fail(
          absl::StrCat(m.domain, " already has a snapshot ", o.name, "; nothing was suspended"),
          false);
  }
  return kOk;
}

int SuspendMembers(GroupRun* run) {
  const absl::Time t = absl::Now();
  std::vector<Member>& members = run->members;
  for (size_t i = 0; i < members.size(); ++i) {
    fprintf(stderr, "%s: suspending its RDMA endpoints and their peers\n",
            members[i].domain.c_str());
    absl::StatusOr<v1::GuestReport> s =
        GuestStep(members[i].dom.get(), run->o.vm.guest_command, {"suspend", "--json"});
    if (!s.ok()) return run->FailResumed(s.status().message(), run->Resume(i));
    *run->rep.add_suspended() = *std::move(s);
  }
  run->rep.set_suspend_us(MicrosSince(t));
  return kOk;
}

int TakeSnapshots(GroupRun* run) {
  const SnapshotOptions& o = run->o;
  const absl::Time t = absl::Now();
  std::vector<std::string> names;
  for (const Member& m : run->members) names.push_back(m.Label());
  const std::string xml =
      absl::StrCat("<domainsnapshot><name>", o.name, "</name><description>",
                   XmlEscape(GroupDescription(names)), "</description></domainsnapshot>");
  std::vector<Snap> taken;
  for (Member& m : run->members) {
    fprintf(stderr, "%s: taking snapshot %s (memory and disks)\n", m.domain.c_str(),
            o.name.c_str());
    Snap s(lv->virDomainSnapshotCreateXML(m.dom.get(), xml.c_str(), 0));
    if (s == nullptr) {
      const std::string cause = LibvirtError(absl::StrCat("snapshot of ", m.domain));
      for (Snap& done : taken) lv->virDomainSnapshotDelete(done.get(), 0);
      return run->FailResumed(cause, run->Resume(run->members.size()));
    }
    taken.push_back(std::move(s));
  }
  run->rep.set_snapshot_us(MicrosSince(t));
  return kOk;
}

// ---- revert

// The member named on the command line, and the others of the group its
// snapshot names (`others`).
int OpenNamedMember(GroupRun* run, std::vector<std::string>* others) {
  const SnapshotOptions& o = run->o;
  if (absl::Status st = OpenMembers({o.vm.domain}, o.vm.connect, false, &run->members); !st.ok())
    return run->Fail(absl::StrCat(st.message(), "; nothing was reverted"), false);
  Snap own(lv->virDomainSnapshotLookupByName(run->members[0].dom.get(), o.name.c_str(), 0));
  if (own == nullptr)
    return run->Fail(LibvirtError(absl::StrCat("snapshot ", o.name, " of ", o.vm.domain)) +
                         "; nothing was reverted",
                     false);
  char* desc = lv->virDomainSnapshotGetXMLDesc(own.get(), 0);
  if (desc == nullptr) return run->Fail(LibvirtError(absl::StrCat("snapshot ", o.name)), false);
  const std::vector<std::string> labels = GroupMembers(ElementText(desc, "description"));
  free(desc);
  if (labels.empty())
    return run->Fail(absl::StrCat("snapshot ", o.name, " of ", o.vm.domain,
                                  " was not taken by `rdmavirtctl snapshot`: its RDMA connections "
                                  "were live in it and cannot come back; nothing was reverted"),
                     false);
  // The member named on the command line is reached the way it was named.
  bool found = false;
  for (const std::string& l : labels) {
    if (!found && ParseMember(l, "").first == o.vm.domain) {
      found = true;
      continue;
    }
    others->push_back(l);
  }
  return kOk;
}

// The other members, each with its snapshot NAME (`snaps`, in member order).
int OpenGroup(GroupRun* run, const std::vector<std::string>& others, std::vector<Snap>* snaps) {
  const SnapshotOptions& o = run->o;
  if (absl::Status st = OpenMembers(others, o.vm.connect, false, &run->members); !st.ok())
    return run->Fail(
        absl::StrCat("a member of the group: ", st.message(), "; nothing was reverted"), false);
  for (const Member& m : run->members) {
    run->rep.add_members(m.Label());
    Snap s(lv->virDomainSnapshotLookupByName(m.dom.get(), o.name.c_str(), 0));
    if (s == nullptr)
      return run->Fail(absl::StrCat(m.domain, " (", m.uri, ") has no snapshot ", o.name,
                                    "; nothing was reverted"),
                       false);
    snaps->push_back(std::move(s));
  }
  return kOk;
}

int RevertMembers(GroupRun* run, const std::vector<Snap>& snaps) {
  const SnapshotOptions& o = run->o;
  const std::vector<Member>& members = run->members;
  const absl::Time t = absl::Now();
  for (size_t i = 0; i < members.size(); ++i) {
    fprintf(stderr, "%s: reverting to %s\n", members[i].domain.c_str(), o.name.c_str());
    if (lv->virDomainRevertToSnapshot(snaps[i].get(), VIR_DOMAIN_SNAPSHOT_REVERT_RUNNING) < 0) {
      std::string done;
      for (size_t j = 0; j < i; ++j) absl::StrAppend(&done, j ? ", " : "", members[j].domain);
      return run->Fail(absl::StrCat(LibvirtError(absl::StrCat("reverting ", members[i].domain)),
                                    done.empty() ? "; nothing was reverted"
                                                 : absl::StrCat("; reverted already: ", done,
                                                                ", their endpoints suspended "
                                                                "until this revert is run again")),
                       false);
    }
  }
  for (const Member& m : members)
    if (absl::Status st = WaitAgent(m.dom.get(), absl::Minutes(2)); !st.ok())
      return run->Fail(absl::StrCat(m.domain, " reverted, but ", st.message()), false);
  run->rep.set_snapshot_us(MicrosSince(t));
  return kOk;
}

}  // namespace

std::pair<std::string, std::string> ParseMember(absl::string_view member,
                                                const std::string& default_uri) {
  const size_t at = member.find('@');
  if (at == absl::string_view::npos) return {std::string(member), default_uri};
  return {std::string(member.substr(0, at)), std::string(member.substr(at + 1))};
}

std::string GroupDescription(const std::vector<std::string>& members) {
  return absl::StrCat(kGroupHeader, "\n", absl::StrJoin(members, "\n"));
}

std::vector<std::string> GroupMembers(absl::string_view description) {
  std::vector<std::string> out;
  std::vector<absl::string_view> lines = absl::StrSplit(description, '\n');
  if (lines.empty() || absl::StripAsciiWhitespace(lines[0]) != kGroupHeader) return out;
  for (size_t i = 1; i < lines.size(); ++i) {
    absl::string_view l = absl::StripAsciiWhitespace(lines[i]);
    if (!l.empty()) out.emplace_back(l);
  }
  return out;
}

bool ValidSnapshotName(absl::string_view name) {
  if (name.empty() || name.size() > 200 || name[0] == '.' || name[0] == '-') return false;
  for (char c : name)
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-')
      return false;
  return true;
}

int Snapshot(const SnapshotOptions& o) {
  GroupRun run(o, "snapshot");
  // ---- checks: every member runs, is an RDMA guest, has no snapshot NAME.
  if (int rc = CheckSnapshotMembers(&run); rc != kOk) return rc;
  // ---- suspend every member: from here on nothing moves between them.
  if (int rc = SuspendMembers(&run); rc != kOk) return rc;
  // ---- one internal snapshot of each: memory and disks.
  if (int rc = TakeSnapshots(&run); rc != kOk) return rc;
  // ---- resume: each reconnects to the others.
  return run.ResumeAll("the snapshots are taken");
}

int Revert(const SnapshotOptions& o) {
  GroupRun run(o, "revert");
  // ---- checks: the group the snapshot names, each member with its snapshot.
  std::vector<std::string> others;
  if (int rc = OpenNamedMember(&run, &others); rc != kOk) return rc;
  std::vector<Snap> snaps;
  if (int rc = OpenGroup(&run, others, &snaps); rc != kOk) return rc;
  // ---- revert every member: its endpoints come back released, as taken.
  if (int rc = RevertMembers(&run, snaps); rc != kOk) return rc;
  // ---- resume, in order: the last one back reconnects them all.
  return run.ResumeAll("reverted");
}

}  // namespace rdmavirt::ctl
