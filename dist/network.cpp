#include "dist/network.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <set>

#include "keel/common/error.h"

namespace keel::dist {
namespace {

std::string hostname() {
  char buf[256] = {0};
  return ::gethostname(buf, sizeof buf - 1) == 0 ? std::string(buf) : std::string("?");
}

std::string numeric(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (sa->sa_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, buf, sizeof buf);
  else if (sa->sa_family == AF_INET6)
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, buf, sizeof buf);
  return buf;
}

// The comma-separated names of `s`, white space around each dropped (an interface name has
// none), empty parts skipped.
std::vector<std::string> split(const std::string& s) {
  static const char* const kSpace = " \t\r\n\v\f";
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = s.find(',', start);
    std::string part = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
    const size_t first = part.find_first_not_of(kSpace);
    part = first == std::string::npos ? std::string() : part.substr(first, part.find_last_not_of(kSpace) - first + 1);
    if (!part.empty()) out.push_back(part);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

}  // namespace

std::vector<std::string> parse_interface_list(const std::string& value, const std::string& source) {
  std::vector<std::string> names = split(value);
  if (!value.empty() && names.empty())
    throw InputError(source + " = \"" + value + "\": no interface name in it (comma-separated names, e.g. \"eth0\")");
  return names;
}

std::vector<std::string> interface_names() {
  std::set<std::string> names;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  for (ifaddrs* a = list; a; a = a->ifa_next)
    if (a->ifa_addr && (a->ifa_addr->sa_family == AF_INET || a->ifa_addr->sa_family == AF_INET6) &&
        (a->ifa_flags & IFF_UP))
      names.insert(a->ifa_name);
  ::freeifaddrs(list);
  return {names.begin(), names.end()};
}

std::string interface_address(const std::string& name) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string v4, v6;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || name != a->ifa_name || !(a->ifa_flags & IFF_UP)) continue;
    if (a->ifa_addr->sa_family == AF_INET && v4.empty()) v4 = numeric(a->ifa_addr);
    if (a->ifa_addr->sa_family == AF_INET6 && v6.empty()) v6 = numeric(a->ifa_addr);
  }
  ::freeifaddrs(list);
  return v4.empty() ? v6 : v4;
}

InterfaceChoice choose_interface(const std::string& configured) {
  InterfaceChoice c;
  std::string raw;
  if (!configured.empty()) {
    raw = configured;
    c.source = "dist.interface";
  } else if (const char* env = std::getenv("GLOO_SOCKET_IFNAME"); env && *env) {
    raw = env;
    c.source = "GLOO_SOCKET_IFNAME";
  }
  c.names = parse_interface_list(raw, c.source);
  for (const auto& n : c.names) {
    if (!interface_address(n).empty()) continue;
    std::string have;
    for (const auto& h : interface_names()) have += (have.empty() ? "" : ", ") + h;
    const bool exists = ::if_nametoindex(n.c_str()) != 0;
    throw InputError(c.source + " = \"" + n +
                     "\": " + (exists ? "that interface is down or has no address" : "no such network interface") +
                     " on host " + hostname() + " (interfaces up here: " + (have.empty() ? "none" : have) + ")");
  }
  return c;
}

bool can_connect(const std::string& host, uint16_t port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) return false;
  bool ok = false;
  for (addrinfo* r = res; r && !ok; r = r->ai_next) {
    const int fd = ::socket(r->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (::connect(fd, r->ai_addr, r->ai_addrlen) == 0) {
      ok = true;
    } else if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof err;
      ok = ::poll(&p, 1, static_cast<int>(timeout.count())) == 1 &&
           ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return ok;
}

std::string local_address_toward(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res) return "";
  std::string out;
  for (addrinfo* r = res; r && out.empty(); r = r->ai_next) {
    const int fd = ::socket(r->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (::connect(fd, r->ai_addr, r->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0)
      out = numeric(reinterpret_cast<sockaddr*>(&local));
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return out;
}

}  // namespace keel::dist
