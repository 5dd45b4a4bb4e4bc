// The data path: the function pointers the inline verbs (ibv_post_send,
// ibv_poll_cq, ibv_wr_*, ibv_start_poll ...) find in shadow objects, and
// the tables by which each QP's path picks its post (context_ops.h
// installs the entries).
//
// Each translates virtual identities to physical ones in place, calls the
// real object's own function pointer, and restores what it changed, so the
// application's work requests are untouched when the call returns. No lock,
// no allocation, no syscall of the shim's own.
#ifndef RDMAVIRT_SHIM_DATAPATH_DATA_PATH_H_
#define RDMAVIRT_SHIM_DATAPATH_DATA_PATH_H_

#include "shim/core/objects.h"

namespace rdmavirt::shim {

// The control thread's way in (migration/release.cc, restore.cc), with the gate closed: post
// through the translating path now, and move a CQ's completions into its
// shadow (pending) list. DrainCq takes the drain's markers out (noting
// them on their QPs), counts and drops the flushes of QPs marked
// `flushing` (their receives still posted), and adds the successful send
// completions it moves to `*sends` if given. The count of completions
// moved, or a negative errno.
int PostSendReal(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad);
int PostRecvReal(Qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad);
int PostSrqRecvReal(Srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad);
int DrainCq(Cq* cq, uint32_t* sends);
// A drain gave up before the markers it posted on `cq`'s QPs completed:
// the CQ translates from now on and its polls drop them (the process
// paused).
void MarkersLate(Cq* cq);

// The wr_ids of a QP's drain markers: addresses inside the shim's own
// object, which no application WR can carry.
inline uint64_t SendMarkerId(const Qp* qp) {
  return reinterpret_cast<uintptr_t>(&qp->send_marker_pending);
}
inline uint64_t RecvMarkerId(const Qp* qp) {
  return reinterpret_cast<uintptr_t>(&qp->recv_marker_seen);
}
inline bool IsMarker(const Qp* qp, uint64_t wr_id) {
  return wr_id == SendMarkerId(qp) || wr_id == RecvMarkerId(qp);
}

// Chooses how a shadow QP's single work requests are posted on the
// translating path (by its type, whether its process is `probed`, and
// whether its peer has moved: SetPeer).
void InstallSendPath(Qp* qp, bool probed);
// Points the probed entries' table of a QP's single sends (Qp::post_probed)
// at what its path word says now. Every change of a QP's path goes
// through SetQpPath or SetQpPaused, which call it (the caller holds the
// shim's lock).
void PublishSendPath(Qp* qp);
void SetQpPath(Qp* qp, Path path);
void SetQpPaused(Qp* qp, bool paused);
// Connects a QP to its peer as the shim knows it (`remote`: where a moved
// peer is now; null: one that never moved), with the table of its single
// sends that goes with it (InstallSendPath). Safe while the application
// posts: a post that sees the peer finds the table that looks it up.
void SetPeer(Qp* qp, const RemoteEndpoint* remote, bool probed);
// The entries above the data path's functions: what context_ops.cc
// installs in shadow objects. One set per kind of process: one the
// migrator cannot move (kDirectEntries), a migratable one
// (kPausableEntries), a migratable one whose pause probes its threads
// (kProbedEntries), and the same for a context whose queues all translate
// (offset mode, or after a move: kProbedTranslatingEntries, and
// kTranslatingFirstEntries for a process the migrator cannot move, whose
// receives take the direct entries).
struct PostPollEntries {
  int (*post_send)(ibv_qp*, ibv_send_wr*, ibv_send_wr**);
  int (*post_recv)(ibv_qp*, ibv_recv_wr*, ibv_recv_wr**);
  int (*post_srq_recv)(ibv_srq*, ibv_recv_wr*, ibv_recv_wr**);
  int (*poll_cq)(ibv_cq*, int, ibv_wc*);
};
extern const PostPollEntries kDirectEntries;
extern const PostPollEntries kPausableEntries;
extern const PostPollEntries kProbedEntries;
extern const PostPollEntries kProbedTranslatingEntries;
extern const PostPollEntries kTranslatingFirstEntries;
extern int (*const kReqNotifyCq)(ibv_cq*, int);
// Every ibv_qp_ex work-request entry and ibv_cq_ex polling entry the shim
// implements (the rest are null), and the one list of them: X(field,
// function) per entry, the functions data_path.cc's own. Memory windows,
// TSO, XRC and tag matching (read_tm_info) are not supported.
#define RDMAVIRT_QP_EX_ENTRIES(X)                 \
  X(wr_start, WrStart)                            \
  X(wr_complete, WrComplete)                      \
  X(wr_abort, WrAbort)                            \
  X(wr_send, WrSend)                              \
  X(wr_send_imm, WrSendImm)                       \
  X(wr_send_inv, WrSendInv)                       \
  X(wr_rdma_write, WrRdmaWrite)                   \
  X(wr_rdma_write_imm, WrRdmaWriteImm)            \
  X(wr_rdma_read, WrRdmaRead)                     \
  X(wr_atomic_cmp_swp, WrAtomicCmpSwp)            \
  X(wr_atomic_fetch_add, WrAtomicFetchAdd)        \
  X(wr_atomic_write, WrAtomicWrite)               \
  X(wr_local_inv, WrLocalInv)                     \
  X(wr_set_ud_addr, WrSetUdAddr)                  \
  X(wr_set_inline_data, WrSetInlineData)          \
  X(wr_set_inline_data_list, WrSetInlineDataList) \
  X(wr_set_sge, WrSetSge)                         \
  X(wr_set_sge_list, WrSetSgeList)
#define RDMAVIRT_CQ_EX_ENTRIES(X)                               \
  X(start_poll, StartPoll)                                      \
  X(next_poll, NextPoll)                                        \
  X(end_poll, EndPoll)                                          \
  X(read_qp_num, ReadQpNum)                                     \
  X(read_src_qp, ReadSrcQp)                                     \
  X(read_opcode, read_opcode)                                   \
  X(read_vendor_err, read_vendor_err)                           \
  X(read_byte_len, read_byte_len)                               \
  X(read_imm_data, read_imm_data)                               \
  X(read_wc_flags, read_wc_flags)                               \
  X(read_slid, read_slid)                                       \
  X(read_sl, read_sl)                                           \
  X(read_dlid_path_bits, read_dlid_path_bits)                   \
  X(read_completion_ts, read_completion_ts)                     \
  X(read_completion_wallclock_ns, read_completion_wallclock_ns) \
  X(read_cvlan, read_cvlan)                                     \
  X(read_flow_tag, read_flow_tag)
extern const ibv_qp_ex kQpExEntries;
extern const ibv_cq_ex kCqExEntries;

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_DATAPATH_DATA_PATH_H_
