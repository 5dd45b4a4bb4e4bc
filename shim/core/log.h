// Diagnostics of a library that lives inside someone else's program: one
// line on stderr per distinct reason, never more (the host's output is
// not ours to flood). RDMAVIRT_LOG=quiet silences it; RDMAVIRT_LOG=moves
// adds a line per QP at each release and resume (its receives' accounting).
// Thread-safe.
#ifndef RDMAVIRT_SHIM_CORE_LOG_H_
#define RDMAVIRT_SHIM_CORE_LOG_H_

namespace rdmavirt::shim {

// Writes "rdmavirt: <why>" once per distinct `why` (a string literal).
void LogOnce(const char* why);
// Writes "rdmavirt: <what>" every time: for rare events (a migration step
// failing), not for anything the application can repeat at will.
void Log(const char* what);
// Whether RDMAVIRT_LOG=moves asked for the per-move accounting.
bool LogMoves();

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_CORE_LOG_H_
