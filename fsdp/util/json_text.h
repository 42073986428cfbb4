// JSON written as text without a document tree, for files written often or from places that must
// not allocate much (a checkpoint's manifest at every step, the flight recorder's dump on a
// failure): strings escaped as JSON requires, numbers in their shortest decimal form. Readers
// parse these files with any JSON parser. Internal to the library.
#pragma once

#include <charconv>
#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

namespace fsdp::util {

/// Appends `s` as a JSON string literal: quotes, backslashes and control characters escaped,
/// UTF-8 passed through (the bytes nlohmann's dump writes for the same string).
inline void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      // The short forms where JSON has them, as nlohmann's dump writes them (the same bytes).
      const char* shortcut = c == '\n'   ? "\\n"
                             : c == '\t' ? "\\t"
                             : c == '\r' ? "\\r"
                             : c == '\b' ? "\\b"
                             : c == '\f' ? "\\f"
                                         : nullptr;
      if (shortcut != nullptr) {
        out += shortcut;
        continue;
      }
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  out += '"';
}

/// `s` as a JSON string literal.
inline std::string json_string(std::string_view s) {
  std::string out;
  append_json_string(out, s);
  return out;
}

/// Appends an integer in decimal.
template <typename Int, typename = std::enable_if_t<std::is_integral_v<Int>>>
void append_json_number(std::string& out, Int v) {
  char buf[24];
  const auto end = std::to_chars(buf, buf + sizeof(buf), v).ptr;
  out.append(buf, end);
}

/// Appends integers as a JSON array, `separator` between them (", ", or "," as a compact dump).
template <typename Ints>
void append_json_array(std::string& out, const Ints& values, std::string_view separator = ", ") {
  out += '[';
  bool first = true;
  for (const auto v : values) {
    if (!first) out += separator;
    first = false;
    append_json_number(out, v);
  }
  out += ']';
}

}  // namespace fsdp::util
