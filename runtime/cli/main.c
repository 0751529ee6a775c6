/* placeholder: the CLI is being written (issue 2) */
#include "tierkv.h"
#include <stdio.h>
int main(void) { fprintf(stderr, "tierkv: not built yet\n"); return 1; }
