#include "tools/trace_report.h"

#include <nlohmann/json.hpp>

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

namespace fsdp::trace {
namespace {

using nlohmann::json;

Collective collective_of(const json& j) {
  Collective c;
  c.seq = j.at("seq").get<int64_t>();
  c.group = j.at("group").get<std::string>();
  c.group_seq = j.at("group_seq").get<int64_t>();
  c.op = j.at("op").get<std::string>();
  c.what = j.at("what").get<std::string>();
  c.state = j.at("state").get<std::string>();
  if (j.contains("group_ranks")) c.group_ranks = j.at("group_ranks").get<std::vector<int>>();
  c.dtype = j.value("dtype", "");
  c.device = j.value("device", "");
  c.numel = j.value("numel", int64_t{0});
  c.bytes = j.value("bytes", int64_t{0});
  c.issued_unix_ms = j.value("issued_unix_ms", int64_t{0});
  c.ended_unix_ms = j.value("ended_unix_ms", int64_t{0});
  return c;
}

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Not std::filesystem: libtorch.so exports a copy of its symbols that crashes when called.
std::vector<std::string> dump_files_in(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.rfind("fsdp-trace-", 0) == 0 && n.size() > 5 && n.substr(n.size() - 5) == ".json") {
        out.push_back(dir + "/" + n);
      }
    }
    ::closedir(d);
  } else {
    throw std::runtime_error("cannot read directory '" + dir + "'");
  }
  std::sort(out.begin(), out.end());
  if (out.empty()) throw std::runtime_error("'" + dir + "' holds no flight-recorder file (fsdp-trace-rank-*.json)");
  return out;
}

std::string clock_text(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  const std::time_t s = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  ::gmtime_r(&s, &tm);
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03d", tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(unix_ms % 1000));
  return buf;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
}

std::string collective_text(const Collective& c) {
  std::ostringstream os;
  os << "#" << c.group_seq << " " << c.what << " (" << c.state;
  if (c.issued_unix_ms > 0) os << ", issued " << clock_text(c.issued_unix_ms);
  if (c.ended_unix_ms > 0) os << ", ended " << clock_text(c.ended_unix_ms);
  os << ")";
  return os.str();
}

bool pending(const Collective& c) {
  return c.state == "issued" || c.state == "timed out" || c.state == "failed";
}

json collective_json(const std::optional<Collective>& c) {
  if (!c) return nullptr;
  return json{{"seq", c->seq},
              {"group", c->group},
              {"group_seq", c->group_seq},
              {"op", c->op},
              {"what", c->what},
              {"state", c->state},
              {"issued_unix_ms", c->issued_unix_ms},
              {"ended_unix_ms", c->ended_unix_ms}};
}

}  // namespace

Dump read_dump(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open '" + path + "': " + std::strerror(errno));
  try {
    const json j = json::parse(in);
    if (j.value("format", "") != "fsdp-flight-recorder") throw std::runtime_error("not a flight-recorder file");
    Dump d;
    d.path = path;
    d.rank = j.at("rank").get<int>();
    d.world_size = j.at("world_size").get<int>();
    d.host = j.value("host", "");
    d.job = j.value("job", "");
    d.pid = j.value("pid", int64_t{0});
    d.reason = j.value("reason", "");
    d.diagnosis = j.value("diagnosis", "");
    d.dump_unix_ms = j.value("dump_unix_ms", int64_t{0});
    d.capacity = j.value("capacity", int64_t{0});
    d.recorded = j.value("recorded", int64_t{0});
    d.peers_read_unix_ms = j.value("peers_read_unix_ms", int64_t{0});
    for (const auto& e : j.at("entries")) d.entries.push_back(collective_of(e));
    for (const auto& p : j.value("peers", json::array())) {
      PeerRecord r;
      r.rank = p.at("rank").get<int>();
      r.who = p.value("who", "");
      r.heartbeat_unix_ms = p.value("heartbeat_unix_ms", int64_t{0});
      r.stale = p.value("stale", false);
      r.exited = p.value("exited", false);
      r.activity = p.value("activity", "");
      r.failure = p.value("failure", "");
      if (p.contains("last_collective") && !p.at("last_collective").is_null()) {
        r.last = collective_of(p.at("last_collective"));
      }
      d.peers.push_back(std::move(r));
    }
    return d;
  } catch (const std::runtime_error& e) {
    throw std::runtime_error("'" + path + "' is not a readable flight-recorder file: " + e.what());
  } catch (const json::exception& e) {
    throw std::runtime_error("'" + path + "' is not a readable flight-recorder file: " + e.what());
  }
}

std::vector<Dump> read_dumps(const std::vector<std::string>& paths) {
  std::vector<Dump> out;
  for (const auto& p : paths) {
    if (is_dir(p)) {
      for (const auto& f : dump_files_in(p)) out.push_back(read_dump(f));
    } else {
      out.push_back(read_dump(p));
    }
  }
  // One file per rank, all of one run: files left by different runs in one directory (the default
  // one is shared) would give a confident, wrong verdict, so they are refused, saying which.
  std::map<int, const Dump*> by_rank;
  for (const auto& d : out) {
    const auto [it, fresh] = by_rank.emplace(d.rank, &d);
    if (!fresh) {
      throw std::runtime_error("two files for rank " + std::to_string(d.rank) + ": '" + it->second->path + "' (pid " +
                               std::to_string(it->second->pid) + ") and '" + d.path + "' (pid " +
                               std::to_string(d.pid) + "). Give the files of one run (one per rank).");
    }
  }
  for (const auto& d : out) {
    if (d.job != out.front().job) {
      throw std::runtime_error("'" + out.front().path + "' and '" + d.path + "' were written by different runs (" +
                               out.front().job + "; " + d.job +
                               "). Give the files of one run: remove the older ones, or set FSDP_FLIGHT_RECORDER_DIR "
                               "per job.");
    }
  }
  for (const auto& d : out) {
    for (const auto& p : d.peers) {  // what this rank's heartbeats said of each peer: the same process
      const auto it = by_rank.find(p.rank);
      if (it == by_rank.end() || p.who.empty()) continue;
      const std::string who = it->second->host + ":" + std::to_string(it->second->pid);
      if (p.who != who) {
        throw std::runtime_error("'" + d.path + "' names rank " + std::to_string(p.rank) + " as process " + p.who +
                                 ", but '" + it->second->path + "' was written by " + who +
                                 ": the files are of different runs. Give the files of one run: remove the older "
                                 "ones, or set FSDP_FLIGHT_RECORDER_DIR per job.");
      }
    }
  }
  std::sort(out.begin(), out.end(), [](const Dump& a, const Dump& b) { return a.rank < b.rank; });
  return out;
}

Report analyze(const std::vector<Dump>& dumps) {
  Report rep;
  std::map<int, const Dump*> file_of;
  // Each group once, by name and members, in the order first seen.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (const auto& d : dumps) {
    file_of[d.rank] = &d;
    rep.ranks_with_files.push_back(d.rank);
    rep.world_size = std::max(rep.world_size, d.world_size);
    for (const auto& e : d.entries) {
      const auto key = std::make_pair(e.group, e.group_ranks);
      if (std::find(groups.begin(), groups.end(), key) == groups.end()) groups.push_back(key);
    }
  }
  // The freshest heartbeat each rank without a file left in the others' records.
  std::map<int, const PeerRecord*> beat_of;
  for (const auto& d : dumps) {
    for (const auto& p : d.peers) {
      auto it = beat_of.find(p.rank);
      if (it == beat_of.end() || it->second->heartbeat_unix_ms < p.heartbeat_unix_ms) beat_of[p.rank] = &p;
    }
  }
  std::set<int> behind_all;
  for (const auto& [name, ranks] : groups) {
    GroupReport g;
    g.name = name;
    g.ranks = ranks;
    for (int r : ranks) {
      Member m;
      m.rank = r;
      if (auto f = file_of.find(r); f != file_of.end()) {
        m.source = "file";
        for (const auto& e : f->second->entries) {
          if (e.group == name && e.group_ranks == ranks && (!m.last || m.last->group_seq < e.group_seq)) m.last = e;
        }
        if (!m.last) m.note = "no collective of this group in its recorder's ring";
      } else if (auto b = beat_of.find(r); b != beat_of.end()) {
        const PeerRecord& p = *b->second;
        m.source = "heartbeat";
        m.heartbeat_unix_ms = p.heartbeat_unix_ms;
        m.note = p.exited ? "exited" : p.stale ? "stopped answering" : "still running";
        if (!p.failure.empty()) m.note += ", failed in " + p.failure;
        if (p.last && p.last->group == name) {
          m.last = p.last;
        } else if (p.last) {
          m.note += "; its last collective was in group " + p.last->group;
        }
      } else {
        m.source = "none";
        m.note = "wrote no file, and no peer recorded its heartbeat";
      }
      g.members.push_back(std::move(m));
    }
    int64_t top = -1;
    for (const auto& m : g.members) {
      if (m.last) top = std::max(top, m.last->group_seq);
    }
    for (const auto& m : g.members) {
      if (m.last && m.last->group_seq == top && pending(*m.last)) {
        g.waiting.push_back(m.rank);
        if (!g.waiting_in || m.source == "file") g.waiting_in = m.last;
      }
    }
    for (const auto& m : g.members) {
      if (m.last && m.last->group_seq < top) g.behind.push_back(m.rank);
    }
    if (g.behind.empty() && !g.waiting.empty()) {
      for (const auto& m : g.members) {
        if (!m.last) g.behind.push_back(m.rank);  // nothing known of it, while the others wait
      }
    }
    std::ostringstream v;
    if (!g.behind.empty()) {
      v << "rank" << (g.behind.size() > 1 ? "s " : " ") << ranks_text(g.behind)
        << (g.behind.size() > 1 ? " are" : " is") << " behind";
      for (const auto& m : g.members) {
        if (std::find(g.behind.begin(), g.behind.end(), m.rank) == g.behind.end()) continue;
        v << "; rank " << m.rank << ": "
          << (m.last ? "its last collective is " + collective_text(*m.last) : "nothing known (" + m.note + ")");
      }
      if (g.waiting_in) {
        v << "; rank" << (g.waiting.size() > 1 ? "s " : " ") << ranks_text(g.waiting) << " wait"
          << (g.waiting.size() > 1 ? "" : "s") << " in " << collective_text(*g.waiting_in);
      }
    } else if (top < 0) {
      v << "nothing recorded in this group";
    } else if (!g.waiting.empty()) {
      v << "no rank is behind: every rank reached #" << top << " " << g.waiting_in->what << "; rank"
        << (g.waiting.size() > 1 ? "s " : " ") << ranks_text(g.waiting)
        << " did not see it complete (the collective itself failed: a link or the backend; or a rank is stuck "
           "inside it)";
    } else {
      v << "no rank is behind: every rank completed #" << top;
    }
    g.verdict = v.str();
    behind_all.insert(g.behind.begin(), g.behind.end());
    rep.groups.push_back(std::move(g));
  }
  rep.behind.assign(behind_all.begin(), behind_all.end());
  return rep;
}

std::string format_text(const std::vector<Dump>& dumps, const Report& report) {
  std::ostringstream os;
  os << "fsdp-trace: " << dumps.size() << " file(s) of a job of " << report.world_size << " rank(s) (times UTC)\n";
  for (const auto& d : dumps) {
    os << "  rank " << d.rank << " (" << d.host << ", pid " << d.pid << "): dumped " << clock_text(d.dump_unix_ms)
       << ", " << d.reason << "; " << d.entries.size() << " of " << d.recorded << " collectives kept\n";
  }
  for (int r = 0; r < report.world_size; ++r) {
    if (std::find(report.ranks_with_files.begin(), report.ranks_with_files.end(), r) == report.ranks_with_files.end())
      os << "  rank " << r << ": no file (stopped, killed, or never dumped)\n";
  }
  for (const auto& g : report.groups) {
    os << "group " << g.name << " (global ranks " << ranks_text(g.ranks) << "):\n";
    for (const auto& m : g.members) {
      os << "  rank " << m.rank << " [" << m.source;
      if (m.source == "heartbeat") os << " of " << clock_text(m.heartbeat_unix_ms);
      if (!m.note.empty() && m.source != "none") os << ", " << m.note;
      os << "]: "
         << (m.last               ? collective_text(*m.last)
             : m.source == "none" ? m.note
                                  : "nothing in this group")
         << "\n";
    }
    os << "  => " << g.verdict << "\n";
  }
  os << (report.behind.empty()
             ? "no rank is behind\n"
             : "behind: rank" + std::string(report.behind.size() > 1 ? "s " : " ") + ranks_text(report.behind) + "\n");
  return os.str();
}

std::string format_json(const Report& report) {
  json j;
  j["world_size"] = report.world_size;
  j["ranks_with_files"] = report.ranks_with_files;
  j["behind"] = report.behind;
  j["groups"] = json::array();
  for (const auto& g : report.groups) {
    json jg{{"name", g.name},
            {"ranks", g.ranks},
            {"behind", g.behind},
            {"waiting", g.waiting},
            {"waiting_in", collective_json(g.waiting_in)},
            {"verdict", g.verdict},
            {"members", json::array()}};
    for (const auto& m : g.members) {
      jg["members"].push_back(json{{"rank", m.rank},
                                   {"source", m.source},
                                   {"heartbeat_unix_ms", m.heartbeat_unix_ms},
                                   {"note", m.note},
                                   {"last", collective_json(m.last)}});
    }
    j["groups"].push_back(std::move(jg));
  }
  return j.dump(2) + "\n";
}

}  // namespace fsdp::trace
