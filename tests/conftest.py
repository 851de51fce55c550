import os
import sys

# Helpers shared by the tests (tiny_models, fakes) live next to them.
sys.path.insert(0, os.path.dirname(__file__))
