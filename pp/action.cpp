#include "pp/action.h"

#include <cctype>
#include <sstream>
#include <stdexcept>

namespace fsdp::pp {
namespace {

struct Spelling {
  ActionKind kind;
  const char* name;
};
// Longest first: "SEND_F" before "F" would never be read as a forward.
constexpr Spelling kSpellings[] = {
    {ActionKind::kSendForward, "SEND_F"},  {ActionKind::kRecvForward, "RECV_F"}, {ActionKind::kSendBackward, "SEND_B"},
    {ActionKind::kRecvBackward, "RECV_B"}, {ActionKind::kForward, "F"},          {ActionKind::kBackward, "B"},
    {ActionKind::kBackwardInput, "I"},     {ActionKind::kBackwardWeight, "W"},
};

const char* name_of(ActionKind kind) {
  for (const auto& s : kSpellings) {
    if (s.kind == kind) return s.name;
  }
  return "?";
}

}  // namespace

bool Action::is_compute() const {
  return kind == ActionKind::kForward || kind == ActionKind::kBackward || kind == ActionKind::kBackwardInput ||
         kind == ActionKind::kBackwardWeight;
}

int64_t Action::peer_stage() const {
  return kind == ActionKind::kSendForward || kind == ActionKind::kRecvBackward ? stage + 1 : stage - 1;
}

std::string Action::text() const {
  return std::to_string(stage) + name_of(kind) + std::to_string(microbatch);
}

Action Action::parse(const std::string& text) {
  auto refuse = [&] {
    throw std::invalid_argument("fsdp::pp: '" + text +
                                "' is not an action: write <stage><F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B><microbatch>, "
                                "e.g. 0F3 or 1SEND_B2");
  };
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) != 0) ++i;
  if (i == 0 || i > 6) refuse();
  for (const auto& s : kSpellings) {
    const std::string name = s.name;
    if (text.compare(i, name.size(), name) != 0) continue;
    const size_t j = i + name.size();
    if (j == text.size() || text.size() - j > 7) refuse();
    for (size_t k = j; k < text.size(); ++k) {
      if (std::isdigit(static_cast<unsigned char>(text[k])) == 0) refuse();
    }
    return Action{s.kind, std::stoll(text.substr(0, i)), std::stoll(text.substr(j))};
  }
  refuse();
  return {};
}

std::string format_lists(const ActionLists& lists) {
  std::ostringstream os;
  for (const auto& list : lists) {
    for (size_t i = 0; i < list.size(); ++i) os << (i > 0 ? "," : "") << list[i].text();
    os << "\n";
  }
  return os.str();
}

ActionLists parse_lists(const std::string& text) {
  ActionLists lists;
  std::istringstream in(text);
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    std::string clean;
    for (const char c : line) {
      if (std::isspace(static_cast<unsigned char>(c)) == 0) clean += c;
    }
    if (clean.empty()) continue;
    std::vector<Action> list;
    std::istringstream entries(clean);
    std::string entry;
    while (std::getline(entries, entry, ',')) {
      if (entry.empty()) continue;
      try {
        list.push_back(Action::parse(entry));
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument("line " + std::to_string(line_no) + " (rank " + std::to_string(lists.size()) +
                                    "): " + e.what());
      }
    }
    lists.push_back(std::move(list));
  }
  return lists;
}

}  // namespace fsdp::pp
