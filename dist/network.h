// dist/network.h: which network interface and address a rank talks on.
//
// Owns: the interface choice (dist.interface, else GLOO_SOCKET_IFNAME as in PyTorch), checking
// that a named interface exists and has an address on this host, and the default when none is
// named: the local address that routes toward the rendezvous host (not the address the
// hostname resolves to, which in containers and network namespaces is often one the host
// does not have).
// Does not own: the store or the process group (dist/process_group.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace keel::dist {

struct InterfaceChoice {
  std::vector<std::string> names;  // empty: none named
  std::string source;              // "dist.interface" or "GLOO_SOCKET_IFNAME"
};

/// The names of an interface list (dist.interface or GLOO_SOCKET_IFNAME: comma-separated, white
/// space around a name ignored); empty for "" (none named). Throws InputError naming `source`
/// and the value when it is set but holds no name ("," or " , "). Host-independent, so that
/// config validation runs it at every world size (a list is refused alike at 1 and N ranks);
/// whether the names exist on this host is choose_interface's check, made before a rendezvous.
std::vector<std::string> parse_interface_list(const std::string& value, const std::string& source = "dist.interface");

/// dist.interface if set, else GLOO_SOCKET_IFNAME (comma-separated, as PyTorch reads it).
/// Throws InputError naming the key, the interface, this host and the interfaces it has when
/// a named interface does not exist here or has no address.
InterfaceChoice choose_interface(const std::string& configured);

/// The first IPv4 (else IPv6) address of interface `name`; "" when it has none.
std::string interface_address(const std::string& name);

/// The local address a connection toward `host` would leave from (a UDP connect, nothing is
/// sent); "" when `host` does not resolve or no route leads to it.
std::string local_address_toward(const std::string& host);

/// Whether a TCP connection to host:port opens within `timeout` (then closed at once). For a
/// failure path that must not wait a store's full timeout on a peer host that is gone.
bool can_connect(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);

/// The names of this host's interfaces that are up and have an address, for messages.
std::vector<std::string> interface_names();

}  // namespace keel::dist
