#include "fsdp/internal/heartbeat_record.h"

#include <algorithm>
#include <sstream>

namespace fsdp::detail {
namespace {

std::string without(std::string s, char bad, char with) {
  std::replace(s.begin(), s.end(), bad, with);
  return s;
}

// Splits `s` at the first `n` occurrences of `sep`: n + 1 fields, or fewer when `s` has fewer.
std::vector<std::string> split_first(const std::string& s, char sep, size_t n) {
  std::vector<std::string> f;
  size_t start = 0;
  while (f.size() < n) {
    const size_t at = s.find(sep, start);
    if (at == std::string::npos) break;
    f.push_back(s.substr(start, at - start));
    start = at + 1;
  }
  f.push_back(s.substr(start));
  return f;
}

}  // namespace

std::string LastCollective::text() const {
  if (!known()) return "none recorded";
  std::ostringstream os;
  os << '#' << seq << ' ' << what << " (group " << group << " #" << group_seq << "), " << state;
  return os.str();
}

std::string encode_heartbeat(int64_t seq, int64_t now_ms, const std::string& who, const std::string& ns,
                             int64_t activity_since, const std::string& activity, bool exited,
                             const LastCollective& last, const std::string& failure) {
  std::ostringstream os;
  os << seq << '|' << now_ms << '|' << who << '|' << ns << '|' << activity_since << '|' << without(activity, '|', '/')
     << '|' << (exited ? 1 : 0) << '|';
  if (last.known()) {
    os << last.seq << ',' << last.group_seq << ',' << without(last.state, ',', ';') << ',' << without(last.op, ',', ';')
       << ',' << without(without(last.group, ',', ';'), '|', '/') << ',' << without(last.what, '|', '/');
  }
  os << '|' << failure;
  return os.str();
}

bool decode_heartbeat(const std::vector<uint8_t>& v, Heartbeat& out) {
  const std::string s(v.begin(), v.end());
  std::vector<std::string> f = split_first(s, '|', 8);
  if (f.size() < 8) return false;
  if (f.size() == 8) f.insert(f.begin() + 7, std::string());  // no last-collective field
  try {
    out.seq = std::stoll(f[0]);
    out.at_ms = std::stoll(f[1]);
    out.who = f[2];
    out.ns = f[3];
    out.activity_since = std::stoll(f[4]);
    out.activity = f[5];
    out.exited = f[6] == "1";
    out.failure = f[8];
    out.last = LastCollective{};
    if (!f[7].empty()) {
      const std::vector<std::string> l = split_first(f[7], ',', 5);
      if (l.size() == 6) {
        out.last.seq = std::stoll(l[0]);
        out.last.group_seq = std::stoll(l[1]);
        out.last.state = l[2];
        out.last.op = l[3];
        out.last.group = l[4];
        out.last.what = l[5];
      }
    }
  } catch (const std::exception&) {
    return false;
  }
  return true;
}

}  // namespace fsdp::detail
