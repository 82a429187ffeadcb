"""A script that ends the ways scripts end: `python exits.py MODE`."""
import signal
import sys
import time

mode = sys.argv[1]
print(f"exits.py: {mode}", flush=True)
if mode == "exit0":
    sys.exit(0)
if mode == "exit-none":
    sys.exit()
if mode == "exit3":
    sys.exit(3)
if mode == "exit-text":
    sys.exit("the data folder is empty")
if mode in ("ignore-sigterm", "own-handler"):
    stop = []
    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore-sigterm"
                  else lambda *_: stop.append(1))
    print("ready", flush=True)
    while not stop:
        time.sleep(0.05)
    print("own handler: saved and leaving", flush=True)
if mode == "notebook-launcher":
    from accelerate import notebook_launcher

    notebook_launcher(print, num_processes=2)
