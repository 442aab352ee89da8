"""The store: tiers in order behind one prefix lookup (``tiered``), built from one
``StoreConfig`` (``config``), with the cost model that decides load or recompute
(``costmodel``) and the disk tier's measured speed kept across restarts (``rates_file``).
"""
