"""Choosing a plan: `fs.auto` and `fs.search_plans`, the fastest estimated plan that fits.

`candidates` lists the points tried, `search` estimates them sharing `traces`, `report` holds what
was found, `auto` is the public entry.
"""
