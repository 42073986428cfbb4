// fsdp::Error: what the library throws is told apart from other errors by its type (never by its
// text), is still a c10::Error for LibTorch programs' catch sites, and carries where it arose
// (global rank, operation, unit, group); error_text gives any exception's message without
// LibTorch's backtrace. The one place that recognizes a foreign error by its text is checked
// against the text the real component (Gloo) throws.
#include "tests/models.h"

#include "fsdp/error.h"
#include "fsdp/internal/foreign_errors.h"

#include <chrono>
#include <optional>
#include <stdexcept>
#include <thread>

namespace fsdp::testing {
namespace {

// Runs `fn` and returns a copy of the fsdp::Error it throws (none: nullopt).
template <typename Fn>
std::optional<fsdp::Error> fsdp_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const fsdp::Error& e) {
    return e;
  }
  return std::nullopt;
}

TEST(ErrorType, CarriesWhereItAroseAndIsACppError) {
  run_ranks(2, [](Rank& r) {
    auto model = fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg, test_options());
    // A model-wide check: rank, operation and group.
    model.set_requires_gradient_sync(false);
    model(torch::randn({2, 7})).sum().backward();
    const auto error = fsdp_error_of([&] { model.zero_grad(); });
    ASSERT_TRUE(error.has_value());
    const fsdp::Error& e = *error;
    EXPECT_EQ(e.rank(), r.rank);
    EXPECT_EQ(e.operation(), "model.zero_grad()");
    EXPECT_EQ(e.group(), "world");
    EXPECT_EQ(e.peer(), -1);
    EXPECT_THROW(model.zero_grad(), c10::Error) << "a LibTorch program's catch site keeps working";
    // error_text: the message, without LibTorch's C++ backtrace, whatever the exception.
    try {
      model.zero_grad();
    } catch (...) {
      const std::string text = fsdp::error_text(std::current_exception());
      EXPECT_EQ(text, e.what_without_backtrace());
      EXPECT_EQ(text.find("Exception raised from"), std::string::npos) << text;
    }
    EXPECT_EQ(fsdp::error_text(std::make_exception_ptr(std::runtime_error("disk full"))), "disk full");
    EXPECT_EQ(fsdp::error_text(std::make_exception_ptr(42)), "an unknown exception");
    model.discard_unsynced_gradients();
    model.set_requires_gradient_sync(true);
    // A unit's own check: the unit too (the model's forward called around the handle reaches unit
    // 'fc1' first).
    const auto u = fsdp_error_of([&] { model->forward(torch::randn({2, 7})); });
    ASSERT_TRUE(u.has_value());
    EXPECT_EQ(u->rank(), r.rank);
    EXPECT_EQ(u->unit(), "fc1");
    // LibTorch's own errors pass through as they are: not an fsdp::Error.
    bool foreign = false;
    try {
      model(torch::randn({2, 3}));  // fc1 takes 7 features
    } catch (const fsdp::Error&) {
    } catch (const c10::Error&) {
      foreign = true;
    }
    EXPECT_TRUE(foreign) << "a shape mismatch in the user's own forward is LibTorch's error";
  });
}

// recognize_foreign_error, against the text Gloo really throws for a wait that times out (rank 1
// joins the all-reduce only after rank 0's wait gave up), and against the abort text of Gloo's
// transport (tests/test_errors.cpp, GlooAbort, shows the abort itself).
TEST(ErrorType, ForeignErrorsAreRecognizedByTheRealText) {
  run_ranks(2, [](Rank& r) {
    std::vector<at::Tensor> t{torch::ones({4})};
    if (r.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    auto work = r.pg->allreduce(t);
    if (r.rank == 0) {
      std::string text;
      try {
        work->wait(std::chrono::milliseconds(200));
      } catch (const std::exception& e) {
        text = e.what();
      }
      EXPECT_EQ(detail::recognize_foreign_error(text), detail::ForeignError::kTimeout) << text;
    }
    work->wait(std::chrono::seconds(30));  // paired once rank 1 joins
    EXPECT_TRUE(t[0].equal(torch::full({4}, 2.0f)));
    EXPECT_EQ(detail::recognize_foreign_error("[enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 32 vs 4. "
                                              "Is there a distributed collective mismatch in your code?"),
              detail::ForeignError::kCollectiveMismatch);
    EXPECT_EQ(detail::recognize_foreign_error("Connection reset by peer"), detail::ForeignError::kOther);
  });
}

}  // namespace
}  // namespace fsdp::testing
