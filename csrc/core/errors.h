// Errors raised by the core. The binding catches these and re-raises them as Python exceptions
// that name the offending argument; nothing else may escape a core entry point.
#pragma once

#include <stdexcept>
#include <string>

namespace opmesh::core {

// A caller mistake: `argument` names the parameter as the user knows it.
class ArgumentError : public std::invalid_argument {
 public:
  ArgumentError(std::string argument, const std::string& message)
      : std::invalid_argument(argument + ": " + message), argument_(std::move(argument)) {}
  const std::string& argument() const noexcept { return argument_; }

 private:
  std::string argument_;
};

}  // namespace opmesh::core
