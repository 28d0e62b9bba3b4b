"""What ran: one usage record per job per node, and the node's Prometheus metrics.

jobfacts.py  what the prolog and the steps learn of a job, kept for its epilog
record.py    the usage record (schema documented there) and its O_APPEND writer
metrics.py   node counters and their Prometheus text for node_exporter's textfile collector
report.py    ``tfimage usage report``: many nodes' logs, aggregated
plot.py      the report's PNG (matplotlib, an optional extra)
"""
