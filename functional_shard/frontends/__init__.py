"""What people touch: the command line, the demo, pictures of plans, the model zoo.

Imports any layer below it; nothing below imports it. `cli/` holds one module per
command, `live_demo` the demo (``fs.demo``), `pictures/` the pictures of a plan
(``Plan.visualize``), `model_zoo` the models (also at ``functional_shard.zoo``).
"""
