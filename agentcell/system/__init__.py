"""`agentcell system install|uninstall`: the one root step that makes agentcell a service of the machine
(docs/system-service.md). units.py writes the systemd units, host.py looks at and changes the host,
plan.py puts the steps in order, each one said before it is made."""
