WHOSE = "the script's"
