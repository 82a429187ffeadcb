"""A module a kernel in tests/ imports, whose name a launched script's own folder also holds
(own_code/own_helper.py): the script must get its own."""
WHOSE = "the kernel's"
