"""The network policy and the egress: what a sandbox may reach, and the one way it reaches it.

A backend calls one interface, `service.Egress` (docs/network.md): `connect(slot, pid)` links a
standby's network namespace to the router, `apply(slot, policy, ...)` writes a tenant's policy at its
claim and at every `update_network`, `disconnect(slot)` forgets it at kill. Everything behind it (the
router namespace and its nftables, the uplink, the resolver, the egress proxy and its process, the
egress CA, connection events) lives here and is the same whatever isolates the sandbox, as long as
the sandbox's traffic arrives on a link of the router.
"""
