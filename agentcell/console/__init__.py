"""The web console (issue 29 §2): the pages under /ui and the API they call (docs/console.md).

app.py mounts it; sessions.py signs people in; upstream.py reaches the server (or gateway) the console
is part of, in process; the other modules are one API each.
"""
