"""The tutorials' own fact checks must be able to fail."""
import pytest
from IPython.utils.capture import capture_output

from gpu_lab.tutorial import check_output


def test_check_output_passes_on_the_expected_text_and_fails_otherwise():
    with capture_output() as cap:
        print("world size 2")
    check_output(cap, "world size 2\n")
    with pytest.raises(AssertionError, match="expects"):
        check_output(cap, "world size 1\n")
