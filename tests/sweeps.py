"""How many examples a drawn test runs when each example starts work on processes or touches
disk: `FEW` in the default suite, the full sweep in a slow twin of the test (``-m slow``).

Pure drawn tests keep the profile's count (tests/conftest.py: 60 under CI).
"""

FEW = 10
