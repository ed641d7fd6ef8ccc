"""Choosing a plan: `fs.auto` and `fs.search_plans`, the fastest estimated plan that fits.

Pure. Imports `core`, `planning` and `costing`: candidates are plans, judged by the
estimate.
"""
