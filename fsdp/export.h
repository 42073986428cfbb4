// What the libraries export. They are built with hidden symbol visibility (-fvisibility=hidden
// -fvisibility-inlines-hidden, CMakeLists.txt), so that their .so files export the public API and
// nothing else: the internals are not an ABI a program could come to depend on.
//
//   - A public header puts its declarations between FSDP_PUBLIC_BEGIN and FSDP_PUBLIC_END: all of
//     them are exported. An internal type it only names (a forward declaration of a detail:: class)
//     is declared FSDP_HIDDEN there, else that declaration would export it.
//   - FSDP_API marks an internal declaration that another of the libraries calls: the core's door
//     (fsdp/internal/core_access.h) and what it hands out (fsdp/internal/comm.h), the checks' throw.
//   - FSDP_TESTING_API marks the internal seams that the tests and tools/ call (docs/design.md,
//     "Exports"); nothing else uses them.
// Polymorphic classes that cross a library boundary are exported whole (their typeinfo too): with
// GCC a hidden typeinfo makes dynamic_cast and catch fail silently across .so files.
#pragma once

#define FSDP_API __attribute__((visibility("default")))
#define FSDP_HIDDEN __attribute__((visibility("hidden")))
#define FSDP_TESTING_API FSDP_API
#define FSDP_PUBLIC_BEGIN _Pragma("GCC visibility push(default)")
#define FSDP_PUBLIC_END _Pragma("GCC visibility pop")
