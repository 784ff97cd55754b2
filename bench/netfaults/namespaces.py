"""Network namespaces joined by veth pairs on a bridge: one namespace per service, so
every hop between services (gRPC, and NIXL over UCX's TCP transport) crosses a real
link that can be cut, made lossy or slow, or partitioned.

Every address lives inside the namespaces (10.X.0.0/24 on the bridge); the host's own
namespace gets no interface and no address. A bridge namespace ("hub") holds the bridge
and the host ends of the veth pairs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

ROLES = ("bootstrap", "prefill", "decode", "router", "client")
DEVICE = "eth0"  # the service's end of its veth pair, inside its namespace
FAULT_TABLE = "pdmesh_fault"


class NamespaceError(RuntimeError):
    """A namespace or link that cannot be made; str() is one line naming the command."""


def sh(*argv: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True, input=stdin, timeout=30)
    if check and out.returncode != 0:
        why = (out.stderr or out.stdout).strip().splitlines()
        raise NamespaceError(f"`{' '.join(argv)}` failed: {why[-1] if why else out.returncode}")
    return out


def unavailable() -> str | None:
    """Why namespaces cannot be used here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); running as uid " \
               f"{os.geteuid()}"
    probe = f"pdmprobe{os.getpid()}"
    try:
        sh("ip", "netns", "add", probe)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    except NamespaceError as e:
        return str(e)
    try:
        sh("ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name",
           "probe1")
    except NamespaceError as e:
        return str(e)
    finally:
        sh("ip", "netns", "del", probe, check=False)
    return None


def netem_unavailable() -> str | None:
    """Why `tc qdisc ... netem` cannot run here (sch_netem missing), or None."""
    probe = f"pdmnetem{os.getpid()}"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "-n", probe, "link", "set", "lo", "up")
        out = sh("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                 "1ms", check=False)
        if out.returncode != 0:
            return f"tc netem: {out.stderr.strip() or out.returncode} (sch_netem is not in " \
                   "this kernel)"
        return None
    except (FileNotFoundError, NamespaceError) as e:
        return f"tc netem: {e}"
    finally:
        sh("ip", "netns", "del", probe, check=False)


def unsupported_faults() -> dict[str, str]:
    """The faults namespaces cannot make on this host, each with why (the proxy covers
    them): delay needs sch_netem, loss and partition need nftables."""
    why: dict[str, str] = {}
    netem = netem_unavailable()
    if netem:
        why["delay"] = netem
    if shutil.which("nft") is None:
        for kind in ("loss", "partition"):
            why[kind] = "the `nft` command (nftables) is not installed"
    return why


@dataclass
class Topology:
    """Namespaces `pdm<tag>-<role>` on one bridge; `ip[role]` is each service's address."""

    tag: str
    subnet: int  # the X of 10.X.0.0/24

    @property
    def hub(self) -> str:
        return f"pdm{self.tag}-hub"

    def ns(self, role: str) -> str:
        return f"pdm{self.tag}-{role}"

    def ip(self, role: str) -> str:
        return f"10.{self.subnet}.0.{ROLES.index(role) + 1}"

    def exec_prefix(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(role)]

    def create(self) -> None:
        try:
            sh("ip", "netns", "add", self.hub)
            sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            for i, role in enumerate(ROLES):
                ns = self.ns(role)
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "link", "add", "name", DEVICE, "netns", ns, "type", "veth", "peer",
                   "name", f"v{i}", "netns", self.hub)
                sh("ip", "-n", self.hub, "link", "set", f"v{i}", "master", "br0", "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.ip(role)}/24", "dev", DEVICE)
                sh("ip", "-n", ns, "link", "set", DEVICE, "up")
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        for ns in (*(self.ns(r) for r in ROLES), self.hub):
            sh("ip", "netns", "del", ns, check=False)

    # faults, each undone by the matching clear
    def cut(self, role: str) -> None:
        sh("ip", "-n", self.ns(role), "link", "set", DEVICE, "down")

    def uncut(self, role: str) -> None:
        sh("ip", "-n", self.ns(role), "link", "set", DEVICE, "up")

    def loss(self, role: str, percent: int) -> None:
        """Drop `percent`% of the packets in and out of the service's link (nftables)."""
        rule = f"iifname {DEVICE} numgen random mod 100 < {percent} drop"
        out_rule = f"oifname {DEVICE} numgen random mod 100 < {percent} drop"
        self._nft(f"""table inet {FAULT_TABLE} {{
  chain i {{ type filter hook input priority 0; policy accept; {rule}; }}
  chain o {{ type filter hook output priority 0; policy accept; {out_rule}; }}
}}""", role)

    def partition(self, role: str, other: str) -> None:
        """Drop every packet between `role` and `other` only (both ways, at `role`)."""
        peer = self.ip(other)
        self._nft(f"""table inet {FAULT_TABLE} {{
  chain i {{ type filter hook input priority 0; policy accept; ip saddr {peer} drop; }}
  chain o {{ type filter hook output priority 0; policy accept; ip daddr {peer} drop; }}
}}""", role)

    def clear_filter(self, role: str) -> None:
        sh("ip", "netns", "exec", self.ns(role), "nft", "delete", "table", "inet", FAULT_TABLE,
           check=False)

    def delay(self, role: str, ms: int) -> None:
        sh("tc", "-n", self.ns(role), "qdisc", "add", "dev", DEVICE, "root", "netem", "delay",
           f"{ms}ms")

    def undelay(self, role: str) -> None:
        sh("tc", "-n", self.ns(role), "qdisc", "del", "dev", DEVICE, "root", check=False)

    def _nft(self, ruleset: str, role: str) -> None:
        sh("ip", "netns", "exec", self.ns(role), "nft", "-f", "-", stdin=ruleset)
