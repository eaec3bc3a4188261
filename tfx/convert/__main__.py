"""python -m tfx.convert: see tfx.convert.run."""

from tfx.convert.run import main

main()
