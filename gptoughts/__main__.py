import sys

from gptoughts.cli import main

sys.exit(main())
