from klpipe.cli import main

main()
