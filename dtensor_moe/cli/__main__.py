import sys

from dtensor_moe.cli import main

sys.exit(main())
