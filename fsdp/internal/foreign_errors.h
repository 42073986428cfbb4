// The one place where the library recognizes another component's error by its text: Gloo and
// c10d throw plain exceptions whose type says nothing, and for two of them the library reacts (a
// timeout is reported as one; a collective of another size, thrown by Gloo's transport thread
// where nothing can catch it, gets an explanation before the abort). Every other "is this ours?"
// is a type test (fsdp::Error). tests/fsdp/test_errors.cpp checks each pattern against the text the
// real component throws. Internal to the library.
#pragma once

#include <string>
#include "fsdp/export.h"

namespace fsdp::detail {

enum class ForeignError {
  kOther,
  kTimeout,             ///< a Gloo work's wait(timeout) ran out ("Operation timed out!"), or its transport's
  kCollectiveMismatch,  ///< Gloo's transport saw a message of another size than the collective expected
};

/// What kind of foreign error `text` (an exception's what()) is.
FSDP_TESTING_API ForeignError recognize_foreign_error(const std::string& text);

}  // namespace fsdp::detail
