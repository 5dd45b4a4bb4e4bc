"""CTest fixture: `up` boots the lab for this test run, `down` stops it.

The lab's owner is the ctest process (our parent): if the run is killed,
the supervisor sees its owner gone and tears everything down.
"""

import os
import sys

from labtest import LAB, labmod

HOSTS = int(os.environ.get("RDMAVIRT_LAB_HOSTS", "3"))

if __name__ == "__main__":
    if sys.argv[1:] == ["up"]:
        if LAB.running():
            LAB.down()
        try:
            took = LAB.up(hosts=HOSTS, owner=os.getppid())
        except labmod.LabError as e:
            print(f"lab up failed: {e}", file=sys.stderr)
            sys.exit(1)
        print(f"lab up: {HOSTS} hosts ready in {took:.1f}s")
    elif sys.argv[1:] == ["down"]:
        LAB.down()
        print("lab down")
    else:
        sys.exit("usage: fixture.py up|down")
