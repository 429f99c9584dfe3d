import sys

from titan.launch.supervisor import main

sys.exit(main(sys.argv[1:]))
