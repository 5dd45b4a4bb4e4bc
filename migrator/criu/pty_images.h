// Pseudo-terminals of a dumped tree renumbered for the host it is restored
// on.
//
// A tree that holds both sides of a pseudo-terminal (orted and the ranks
// whose output it reads, a terminal multiplexer and its shells) is dumped
// with the terminal's index, N of /dev/pts/N, and CRIU restores the pair
// only at that index: it opens /dev/ptmx until the kernel hands it N, and
// fails ("Unable to open dev/ptmx with specified index") when a process
// of the destination already holds N. Nothing in the tree depends on the
// number itself (the slave's path is what ttyname(3) would print), so
// before a restore the images are rewritten to give each colliding pair
// the lowest index that is free on this host and not the tree's own.
//
// What CRIU 3.17 writes of a pseudo-terminal (criu/tty.c, images/tty.proto,
// fdinfo.proto, regfile.proto), and so what is rewritten, field by field,
// every other byte kept:
//   tty-info.img  TtyInfoEntry: id (index << 1 | master), rdev (the
//                 slave's minor is the index), pty.index
//   tty-data.img  TtyDataEntry: tty_id (an id as above)
//   files.img     FileEntry.tty: tty_info_id (an id as above);
//                 FileEntry.reg: name "/dev/pts/N" (the path CRIU opens
//                 the slave by)
// The originals are kept in DIR/pty-originals/ while the restore runs and
// put back afterwards (PutBackPtyImages), so that the directory still
// matches its manifest and can be restored again elsewhere.
//
// Thread-compatible: one call at a time per directory.
#ifndef RDMAVIRT_MIGRATOR_CRIU_PTY_IMAGES_H_
#define RDMAVIRT_MIGRATOR_CRIU_PTY_IMAGES_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdmavirt::migrator {

inline constexpr char kPtyOriginalsDir[] = "pty-originals";

// The pseudo-terminal indexes in use on this host: the numeric entries of
// `devpts` (a slave exists there from the master's open to the last close).
std::set<uint32_t> PtysInUse(const std::string& devpts = "/dev/pts");

// Rewrites the images in `dir` so that no pseudo-terminal of the tree has
// an index in `taken`; returns old index -> new index for those it moved
// (empty, and nothing written, when none collides or the tree holds no
// pseudo-terminal). Originals left by an earlier call that was not put
// back are put back first. Errors: DATA_LOSS when an image does not parse
// (nothing is changed then), INTERNAL when a file cannot be written (what
// was written is put back).
absl::StatusOr<std::map<uint32_t, uint32_t>> RenumberPtys(const std::string& dir,
                                                          const std::set<uint32_t>& taken);

// Puts the originals RenumberPtys kept back in place; OK when there are
// none.
absl::Status PutBackPtyImages(const std::string& dir);

}  // namespace rdmavirt::migrator

#endif  // RDMAVIRT_MIGRATOR_CRIU_PTY_IMAGES_H_
