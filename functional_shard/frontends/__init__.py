"""What people touch: the command line, the demo, pictures of plans, the model zoo.

Imports any layer below it; nothing below imports it.
"""
