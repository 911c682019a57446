"""The record's collectors on a linux host: the kernel tracer or audit (processes, refusals),
fanotify (files), cgroups and the kernel log (limits). They run in a child process of the server
(`process.py`) and speak the protocol of `target.py`."""
