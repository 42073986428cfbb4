// fsdp::Error: what the library throws is told apart from other errors by its type (never by its
// text), is still a c10::Error for LibTorch programs' catch sites, and carries where it arose
// (global rank, operation, unit, group); error_text gives any exception's message without
// LibTorch's backtrace. The one place that recognizes a foreign error by its text is checked
// against the text the real component (Gloo) throws.
#include "tests/models.h"

#include "fsdp/error.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/foreign_errors.h"
#include "optim/grad_scaler.h"

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

// One rendering of "who raised it" for every library call: the message begins with the context's
// api, rank, job size, mesh place and path, as far as each is known, and the error carries them.
TEST(ErrorType, MessagesBeginWithTheCallerTheirContextNames) {
  using fsdp::detail::error_caller;
  EXPECT_EQ(error_caller(ErrorContext().api("fsdp::x")), "fsdp::x");
  EXPECT_EQ(error_caller(ErrorContext().api("fsdp::x").rank(3)), "fsdp::x (rank 3)");
  EXPECT_EQ(error_caller(ErrorContext().api("fsdp::x").rank(3).world_size(8)), "fsdp::x (rank 3 of 8)");
  EXPECT_EQ(error_caller(ErrorContext().api("fsdp::x").rank(3).world_size(8).path("ck/step-1")),
            "fsdp::x (rank 3 of 8, 'ck/step-1')");
  EXPECT_EQ(error_caller(ErrorContext().api("fsdp::x").rank(3).mesh("(tp 1) of mesh (tp 2)")),
            "fsdp::x (global rank 3 at (tp 1) of mesh (tp 2))");
  const auto thrown = fsdp_error_of([] {
    FSDP_CHECK_IN(ErrorContext().api("fsdp::x").rank(1).world_size(2).operation("op"), false, "what; remedy.");
  });
  ASSERT_TRUE(thrown.has_value());
  EXPECT_EQ(std::string(thrown->what_without_backtrace()).rfind("fsdp::x (rank 1 of 2): what; remedy.", 0), 0u)
      << thrown->what_without_backtrace();
  EXPECT_EQ(thrown->api(), "fsdp::x");
  EXPECT_EQ(thrown->operation(), "op");
  // A real call's: the rank is the model's, the api the call's.
  run_ranks(2, [](Rank& r) {
    auto model = fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg, test_options());
    const auto e = fsdp_error_of(
        [&] { fsdp::optim::ShardedGradScaler(model, fsdp::optim::GradScalerOptions().init_scale(-1.0)); });
    ASSERT_TRUE(e.has_value());
    const std::string text = e->what_without_backtrace();
    EXPECT_EQ(
        text.rfind("fsdp::optim::ShardedGradScaler (rank " + std::to_string(r.rank) + " of 2): init_scale is -1", 0),
        0u)
        << text;
    EXPECT_EQ(e->api(), "fsdp::optim::ShardedGradScaler");
    EXPECT_EQ(e->rank(), r.rank);
  });
}

// recognize_foreign_error, against the text Gloo really throws for a wait that times out (rank 1
// joins the all-reduce only after rank 0's wait gave up), and against the abort text of Gloo's
// transport (tests/fsdp/test_errors.cpp, GlooAbort, shows the abort itself).
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
    // Gloo's transport, when its own timeout ends a send first (seen in
    // FlightRecorder.StoppedPeerIsNamedBehindAtItsLastCollective on a loaded machine).
    EXPECT_EQ(detail::recognize_foreign_error("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
                                              "Timed out waiting 3000ms for send operation to complete"),
              detail::ForeignError::kTimeout);
    EXPECT_EQ(detail::recognize_foreign_error("Connection reset by peer"), detail::ForeignError::kOther);
  });
}

}  // namespace
}  // namespace fsdp::testing
