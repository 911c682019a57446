"""The behaviour record: what a sandbox's code did, observed from outside it (docs/record.md).

`events.py` is an event's shape (and its class), `store.py` keeps events per sandbox within per-sandbox
bounds of which each class of event keeps a reserved share, `flags.py` raises flags on every event
seen (by the store, stored or not, and by the report), `report.py` sums a record up for a reviewer. Collectors that watch a sandbox from a
linux host are in `linux/`; a backend calls the one interface there (`linux.target`: watch a standby,
say when it is claimed, unwatch it at its end), and the server's API calls add their own events.
"""
