import sys

from changefeed.cli import main

sys.exit(main())
