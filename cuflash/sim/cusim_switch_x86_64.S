/* cuflash CUDA simulator: fiber context switch for x86-64 (System V ABI).
 *
 *   void cusim_switch(void** save_sp, void* new_sp);
 *
 * Pushes the callee-saved registers (rbp, rbx, r12-r15) on the current stack, stores the stack
 * pointer in *save_sp, loads new_sp and pops the same registers from there; `ret` then resumes
 * the other context where it called cusim_switch (or, for a fresh fiber, at the entry address
 * the launcher placed on its stack). Caller-saved registers are the caller's business by the ABI.
 * No system call is made, unlike swapcontext(), which saves the signal mask on every switch.
 */
    .text
    .p2align 4
    .globl cusim_switch
    .hidden cusim_switch
    .type cusim_switch, @function
cusim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cusim_switch, .-cusim_switch

    .section .note.GNU-stack,"",@progbits
