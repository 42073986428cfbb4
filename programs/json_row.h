// The one JSON writer of the programs (examples, benchmarks, tools): a row is an ordered JSON
// object (nlohmann::ordered_json, keys in the order added) printed as one line on stdout.
//
//   fsdp::programs::JsonRow().add("step", step).add("loss", loss, "%.9g").print();
//
// A number given with a printf format keeps that format's precision (the value printf would
// print, read back); a number that is not finite is null: JSON has no token for NaN or infinity,
// and a strict parser (json.loads with parse_constant, jq) refuses "nan".
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

namespace fsdp::programs {

/// `v` as printf's `format` ("%.9g", "%.3f") prints it, read back; NaN or infinity as they are.
double rounded(double v, const char* format);
/// Each of `v` rounded().
std::vector<double> rounded(const std::vector<double>& v, const char* format);

/// `j` as one line on stdout, flushed (a reader of a pipe sees each row as it is printed).
void print_row(const nlohmann::ordered_json& j);

class JsonRow {
 public:
  template <class T>
  JsonRow& add(const std::string& key, T&& value) {
    j_[key] = std::forward<T>(value);
    return *this;
  }
  /// A number in `format`'s precision, null when not finite.
  JsonRow& add(const std::string& key, double value, const char* format);

  nlohmann::ordered_json& json() { return j_; }
  std::string text() const { return j_.dump(); }
  void print() const { print_row(j_); }

 private:
  nlohmann::ordered_json j_ = nlohmann::ordered_json::object();
};

}  // namespace fsdp::programs
