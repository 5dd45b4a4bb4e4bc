// Diagnostics of a library that lives inside someone else's program: one
// line on stderr per distinct reason, never more (the host's output is
// not ours to flood). RDMAVIRT_LOG=quiet silences it. Thread-safe.
#ifndef RDMAVIRT_SHIM_LOG_H_
#define RDMAVIRT_SHIM_LOG_H_

namespace rdmavirt::shim {

// Writes "rdmavirt: <why>" once per distinct `why` (a string literal).
void LogOnce(const char* why);

}  // namespace rdmavirt::shim

#endif  // RDMAVIRT_SHIM_LOG_H_
