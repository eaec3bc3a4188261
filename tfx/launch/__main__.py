from tfx.launch.cli import main

main()
