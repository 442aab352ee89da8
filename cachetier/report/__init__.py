"""``cachetier report``: hit-rate reports from an event log, server stats or a trace replay.

- ``config``: what to report on and with which settings (``ReportConfig``).
- ``inputs``: reading the event log, the stats and the trace, with one-line errors.
- ``hierarchy_replay`` / ``workers`` / ``lookup``: a trace replayed through two tiers looked
  up as a ``TieredStore`` does (the per-tier figures), plus the capacity curve's single-cache
  replays from ``cachetier.report.replay``, spread over forked helpers, one per core.
- ``sampled`` / ``admission_sampled``: the curve and the admission replays on a stratified
  hashed sample of keys (SHARDS), sized for an error bound; ``--exact`` replays every key.
- ``figures`` / ``curve`` / ``counters``: every figure as a plain dict (what the JSON holds
  and the plots draw): lookup figures, the trace-only ones, the tier counters table.
- ``plots`` / ``html`` / ``summary``: the PNGs, the self-contained page, the terminal text.
- ``svg`` / ``svg_figures`` / ``page_script``: the page's hoverable SVG plots (per tier, per
  tenant, the capacity curve) and its one inline script (sorting, tenant filter, tooltips).
- ``build``: the steps in order.

Needs the ``report`` extra (matplotlib, tqdm); nothing outside this package but the command
imports it.
"""
