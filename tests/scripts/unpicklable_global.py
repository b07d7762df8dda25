"""Like a notebook: a function defined in __main__ uses a global that cannot be pickled.

    python unpicklable_global.py

ranch must raise PayloadError naming that global, before starting any rank. The
script records every process start (audit hook) and whether a template exists.
Run with MPIFY_NB_PREWARM=0, so that no template is started at import.
"""

import socket
import sys

import mpify_nb
from mpify_nb.start import template

started = []
sys.addaudithook(lambda event, args: started.append(event) if event in (
    "subprocess.Popen", "os.fork", "os.posix_spawn") else None)

CONNECTION = socket.socket()  # cannot be pickled


def send_hello():
    CONNECTION.send(b"hello")


try:
    mpify_nb.ranch(2, send_hello)
    print("NO-ERROR")
except mpify_nb.PayloadError as e:
    print("PAYLOAD-ERROR", e)
print("PROCESSES-STARTED", len(started))
print("TEMPLATE", template._client is not None)
