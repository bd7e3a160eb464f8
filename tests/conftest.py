import os

from hypothesis import settings

# CI runs the property tests with a fixed seed so that a submission's result does not depend
# on the draw; locally they explore new examples every run.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
