#include "programs/json_row.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>

namespace fsdp::programs {

double rounded(double v, const char* format) {
  if (!std::isfinite(v)) return v;
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, v);
  return std::strtod(buf, nullptr);
}

std::vector<double> rounded(const std::vector<double>& v, const char* format) {
  std::vector<double> out;
  out.reserve(v.size());
  for (double x : v) out.push_back(rounded(x, format));
  return out;
}

void print_row(const nlohmann::ordered_json& j) {
  std::cout << j.dump() << std::endl;
}

JsonRow& JsonRow::add(const std::string& key, double value, const char* format) {
  j_[key] = rounded(value, format);  // nlohmann writes NaN and infinity as null
  return *this;
}

}  // namespace fsdp::programs
