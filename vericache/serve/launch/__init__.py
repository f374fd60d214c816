"""Starting a server: its workers in this process or as Ray actors (cluster.py), the background
server that runs a coordinator and its APIs on an event loop of its own (server.py), and the
long-context server (long_context.py). May import every other part of serve."""
