import sys

from hf_spec.cli import main

sys.exit(main())
