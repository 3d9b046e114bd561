// Schema strings from the call structs of op_defs.h.
#include "op_call.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <cstring>

namespace opmesh::binding {

namespace {

// The schema's type for a kind; a written-in-place tensor gets the next alias letter.
std::string schema_type(const char* kind, char& alias) {
  static const std::pair<const char*, const char*> types[] = {
      {"Tensor", "Tensor"}, {"OptTensor", "Tensor?"}, {"Ints", "Tensor"}, {"OptInts", "Tensor?"},
      {"Float", "float"},   {"OptFloat", "float?"},   {"Int", "int"},     {"OptInt", "int?"},
      {"SymInt", "SymInt"}, {"OptSymInt", "SymInt?"}, {"Str", "str"},     {"Bool", "bool"},
  };
  if (std::strcmp(kind, "MutTensor") == 0) return std::string("Tensor(") + alias++ + "!)";
  if (std::strcmp(kind, "OptMutTensor") == 0) return std::string("Tensor(") + alias++ + "!)?";
  for (const auto& [k, t] : types) {
    if (std::strcmp(kind, k) == 0) return t;
  }
  TORCH_CHECK(false, "op_defs.h: unknown kind ", kind);
}

}  // namespace

std::string schema_of(const char* name, const std::vector<ops::Field>& fields,
                      const std::vector<std::string>& defaults, const char* returns) {
  std::string s = std::string(name) + "(";
  char alias = 'a';
  bool kw = false;
  for (size_t i = 0; i < fields.size(); ++i) {
    const ops::Field& f = fields[i];
    if (i > 0) s += ", ";
    if (f.kw_only && !kw) {
      s += "*, ";
      kw = true;
    }
    s += schema_type(f.kind, alias) + " " + f.name;
    if (f.has_default) s += "=" + defaults[i];
  }
  return s + ") -> " + returns;
}

namespace detail {

std::string schema_literal(const at::Tensor&) { return "None"; }

std::string schema_literal(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", v);
  std::string s(text);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::string schema_literal(int64_t v) { return std::to_string(v); }
std::string schema_literal(bool v) { return v ? "True" : "False"; }
std::string schema_literal(const c10::SymInt& v) { return std::to_string(v.expect_int()); }
std::string schema_literal(const std::string& v) { return "\"" + v + "\""; }

}  // namespace detail

}  // namespace opmesh::binding
