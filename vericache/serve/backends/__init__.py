"""Where and how a request runs, behind the coordinator: the distributed backend (placement by
prefix, auto's choice of path, a request's rounds and the schedules that place them, migrations
when a worker dies), the long-context backend over one engine, and the metrics the coordinator
reports. Imports workers/, store/ and serve's shared modules."""
