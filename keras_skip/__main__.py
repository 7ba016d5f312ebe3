import sys

from keras_skip.cli import main

sys.exit(main())
