# Makes the package in bindings/python importable without installing it. With
# GRADACC_TEST_INSTALLED=1 (scripts/python-wheel-check) the tests import the installed package instead.
import os
import sys

if os.environ.get("GRADACC_TEST_INSTALLED") != "1":
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
